"""cgdp: CPU-GPU data parallel training (Le et al., ICPE '18). See README.md."""
