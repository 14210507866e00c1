"""hybrid_mp: hybrid data x model parallelism and DLPlacer's ILP device placement (Pal et al.)."""
