"""One module per screen: live, profile, tuners, trials, apply, help (and the confirmation dialog)."""
