"""Local stand-in: the CPU variant of a model repository (cpu_variant: configs and the CPU models, no server extra
needed, so the kit image renders it) and a real tritonserver launcher (launcher: needs the server extra)."""
