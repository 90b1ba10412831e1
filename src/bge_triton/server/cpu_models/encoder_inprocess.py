"""CPU stand-in only: the text endpoint's encoder run in its own process with ONNX Runtime.

server.cpu_variant copies this file beside the shipped model.py in the rendered repository and
sets the text endpoint's parameter encoder "inprocess"; model.py then loads it instead of BLS.
On the GPU the encoder is the C++ onnxruntime backend and BLS stays inside the server; here the
stand-in encoder is a second python stub, so one CPU request crosses one stub instead of two.
Its own parameters (not text settings): intra_op_threads, allow_spinning, cpu_lock.
"""
import fcntl
import os

from text_core import EncoderBackend, TextSettings, encoder_error, truthy


def _param(cfg: dict, key: str, default: str) -> str:
    return cfg.get("parameters", {}).get(key, {}).get("string_value", default)


class _FileLock:
    """Holds the repository's .cpu_compute.lock for a whole Triton batch (a context manager)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a+")

    def __enter__(self):
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)


class InProcessBackend(EncoderBackend):
    """ONNX Runtime on the encoder model's newest model.onnx, on CPU.

    With parameter cpu_lock "1", every ORT run of the repository (this and the encoder model's
    instances) takes turns through one file lock: ORT uses every core for one run. The text endpoint's
    dispatcher holds it around each sub-batch (text_scheduler).
    """

    def __init__(self, settings: TextSettings, cfg: dict, args: dict) -> None:
        import onnxruntime as ort

        self.model = settings.onnx_model
        root = os.path.dirname(os.path.normpath(args["model_repository"]))
        encoder_dir = os.path.join(root, self.model)
        versions = sorted((int(v) for v in os.listdir(encoder_dir) if v.isdigit()), reverse=True) \
            if os.path.isdir(encoder_dir) else []
        path = next((p for p in (os.path.join(encoder_dir, str(v), "model.onnx") for v in versions)
                     if os.path.isfile(p)), None)
        if path is None:
            raise FileNotFoundError(f"encoder=inprocess needs {encoder_dir}/<version>/model.onnx: run "
                                    "`bge-triton export --model-id <hub id or dir> --repository <repo>` first")
        opts = ort.SessionOptions()
        threads = int(_param(cfg, "intra_op_threads", "0"))
        if threads > 0:
            opts.intra_op_num_threads = threads
        spinning = "1" if truthy(_param(cfg, "allow_spinning", "0")) else "0"
        opts.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        if spinning == "1":  # spin inside a run only: stop when it returns, so idle threads steal nothing
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.output = self.session.get_outputs()[0].name  # embedding (embedder) or score (reranker)
        self.lock = _FileLock(os.path.join(root, ".cpu_compute.lock")) \
            if truthy(_param(cfg, "cpu_lock", "0")) else None

    def run(self, ids, mask, **extra):
        feeds = {k: v for k, v in (("input_ids", ids), ("attention_mask", mask), *extra.items()) if k in self.inputs}
        try:
            return self.session.run([self.output], feeds)[0]
        except Exception as exc:  # ORT's own exception types: answer the sub-batch, keep the model up
            raise encoder_error(f"{self.model} (in-process)", f"batch {list(ids.shape)}: {exc}") from exc

    def hold(self):
        return self.lock if self.lock is not None else super().hold()

    def close(self) -> None:
        if self.lock is not None:
            self.lock.file.close()


def make_backend(settings: TextSettings, cfg: dict, args: dict) -> EncoderBackend:
    """The hook model.py calls for encoder "inprocess"."""
    return InProcessBackend(settings, cfg, args)
