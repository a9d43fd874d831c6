"""Launching runs on a cluster: `slurm.py` renders and submits SLURM jobs (for `attnlab fit --slurm` and
`attnlab ablate submit`); `job.py` is what runs inside them (`python -m attnlab.launch.job task|prepare`);
`requeue.py` is the Trainer's side of preemption (checkpoint and requeue on USR1)."""
