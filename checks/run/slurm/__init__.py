"""The Slurm back end of `checks run --backend slurm`: what the site offers (``offer``), how a run becomes jobs and
their batch scripts (``batch``), the runner on the allocated node (``node``), what Slurm says of a job and what
that makes of its unfinished variants (``acct``), and the back end that submits, follows and records them
(``backend``)."""
