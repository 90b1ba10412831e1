"""Lay the nvidia-pytriton wheel's tritonserver out at the NGC image's paths (deploy/standins/Dockerfile.tritonserver).

Usage: python3 layout_pytriton.py WHEEL. Keeps the python backend stub of the running Python only.
"""
import os
import shutil
import sys
import sysconfig
import zipfile

py = sysconfig.get_python_version()
dst = "/opt/tritonserver"
with zipfile.ZipFile(sys.argv[1]) as whl:
    for info in whl.infolist():
        name = info.filename
        if name.startswith("pytriton/tritonserver/") and not name.endswith("/"):
            rel = name[len("pytriton/tritonserver/"):]
            if rel.startswith("python_backend_stubs/"):
                if not rel.startswith(f"python_backend_stubs/{py}/"):
                    continue
                rel = "backends/python/" + os.path.basename(rel)
        elif name.startswith("nvidia_pytriton.libs/") and not name.endswith("/"):
            rel = "lib/" + os.path.basename(name)
        else:
            continue
        out = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with whl.open(info) as src, open(out, "wb") as f:
            shutil.copyfileobj(src, f)
        os.chmod(out, 0o755)
stub = f"{dst}/backends/python/triton_python_backend_stub"
if not os.path.isfile(stub):
    sys.exit(f"the wheel has no python backend stub for Python {py}")
