"""Local stand-in: the model repository as code, the CPU variant it renders, and a real tritonserver launcher."""

from bge_triton.extras import require

require("server", "bge_triton.server (the local tritonserver)")
