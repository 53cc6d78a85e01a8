"""Launch scripts: ``curriculum.py`` (torchrun entry point) and ``slurm/`` (sbatch scripts)."""
