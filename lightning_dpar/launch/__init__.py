"""Starting the ranks: device selection, the process group (and its backend per device), and the launchers
(torchrun, SLURM, Ray, spawn) with resume discovery (`ckpt_path="last"`)."""

__all__: list[str] = []
