"""Launching dilocox: one-host cluster emulation (network namespaces + veth + tc) and torchrun.

``dilocox.launch.emulate`` holds the library (``Cluster``, ``launch``, ``launch_main``); the
stand-alone scripts (``launcher/emulate.py``, ``launcher/run_local.sh``, ``launcher/slurm/``)
live outside the package and call into it.
"""
