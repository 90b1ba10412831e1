#!/bin/bash
# Stand-in for the NGC image's /opt/nvidia/nvidia_entrypoint.sh: the real one prints the NVIDIA banner and
# checks the driver, then runs its arguments; this one only runs them (no GPU here).
if [ $# -eq 0 ]; then exec /bin/bash; fi
exec "$@"
