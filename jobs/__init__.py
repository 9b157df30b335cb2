"""The top layer: the ``ernie5`` command line and the jobs that orchestrate training, sweeps and reports."""
