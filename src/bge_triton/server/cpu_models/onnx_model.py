"""CPU stand-in for the onnxruntime backend: a Triton python-backend model running ONNX Runtime.

Rendered by server.cpu_variant as <NAME>_onnx/1/model.py. Same name, inputs, outputs and
dynamic_batching as the GPU config. Executor `costmodel` sleeps a + b*B*L microseconds instead
(an emulated GPU, labelled so by every report that uses it). All instances of one costmodel model
share one emulated GPU: a file lock in the model's directory is held while a Triton batch "runs", so two
instances overlap their hand-offs but not their compute, as two instances on one GPU do. With
parameter cpu_lock "1", executor `onnxruntime` takes turns the same way through the repository's
.cpu_compute.lock, shared with the text endpoint's in-process encoder, encoder_inprocess.py
(ORT uses every core per run).
"""
import fcntl
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _wait_until(deadline: float, spin_s: float = 0.0003) -> None:
    """Sleep until perf_counter() reaches deadline; the last spin_s is spun. Making the random vectors (0.5 ms
    for 44 x 1024) and sleep's overshoot (0.1-0.2 ms on the 2-core VM) are the emulator's, not GPU time: a
    plain sleep(t) after them held the emulated GPU about 1.5% longer than the cost model per sub-batch."""
    while (left := deadline - time.perf_counter()) > spin_s:
        time.sleep(left - spin_s)
    while time.perf_counter() < deadline:
        pass


def _param(cfg, key, default):
    return cfg.get("parameters", {}).get(key, {}).get("string_value", default)


def _input_error(message):
    """A per-request input problem: INVALID_ARG (HTTP 400), so clients never retry it."""
    try:
        return pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
    except (AttributeError, TypeError):  # older python_backend without error codes
        return pb_utils.TritonError(message)


def _vocab_size(path):
    """Rows of the word-embedding table feeding input_ids (None if it cannot be found)."""
    try:
        import onnx

        model = onnx.load(path, load_external_data=False)
        shapes = {init.name: list(init.dims) for init in model.graph.initializer}
        ids = {"input_ids"}  # input_ids and what Cast/Identity nodes derive from it (fusion casts to int32)
        for node in model.graph.node:
            if node.op_type in ("Cast", "Identity") and node.input and node.input[0] in ids:
                ids.update(node.output)
        for node in model.graph.node:
            if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in ids:
                table = node.input[0]
            elif node.op_type == "EmbedLayerNormalization" and node.input and node.input[0] in ids:
                table = node.input[2]
            else:
                continue
            if shapes.get(table):
                return int(shapes[table][0])
    except Exception:  # best effort: the check is an extra, ORT still guards the Gather
        return None
    return None


class TritonPythonModel:
    """Runs one Triton batch (requests of equal sequence length) as one ONNX Runtime call."""

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.dim = int(cfg["output"][0]["dims"][-1])
        self.output = cfg["output"][0]["name"]  # embedding (embedder) or score (reranker)
        self.extra_inputs = [i["name"] for i in cfg.get("input", [])
                             if i["name"] not in ("input_ids", "attention_mask")]  # token_type_ids (BERT rerankers)
        self.executor = _param(cfg, "executor", "onnxruntime")
        self.cost_a = float(_param(cfg, "cost_a_us", "6260")) / 1e6
        self.cost_b = float(_param(cfg, "cost_b_us", "10")) / 1e6
        self.rng = np.random.default_rng(0)
        self.run_lock = None  # held while a batch runs: the emulated GPU, or the CPU's cores
        if self.executor == "costmodel":
            self.run_lock = open(os.path.join(args["model_repository"], ".emulated_gpu.lock"), "a+")
        elif _param(cfg, "cpu_lock", "0").strip().lower() in ("1", "true"):
            # ORT uses every core for one run: instances (and the text endpoint's in-process encoder) take
            # turns through one file in the repository, the same one the text endpoint's encoder_inprocess.py opens.
            root = os.path.dirname(os.path.normpath(args["model_repository"]))
            self.run_lock = open(os.path.join(root, ".cpu_compute.lock"), "a+")
        self.session = None
        self.vocab_size = int(_param(cfg, "vocab_size", "0")) or None
        # Fault injection for tests only (CPU stand-in): a request holding token fault_token_id is answered with
        # an embedding one column short (fault "shape") or an error (fault "raise"). 0 = off.
        self.fault_token = int(_param(cfg, "fault_token_id", "0"))
        self.fault = _param(cfg, "fault", "shape")
        if self.executor == "onnxruntime":
            import onnxruntime as ort

            path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
            if not os.path.isfile(path):
                raise pb_utils.TritonModelException(
                    f"{path} is missing: run `bge-triton export --model-id <hub id or dir> --repository <repo> "
                    "--model <name>` first")
            opts = ort.SessionOptions()
            threads = int(_param(cfg, "intra_op_threads", "0"))
            if threads > 0:
                opts.intra_op_num_threads = threads
            # allow_spinning "1" (the CPU variant's default): threads spin while a run lasts and stop when
            # it returns; spinning that outlives a run steals the cores Triton and the clients share.
            spinning = "1" if _param(cfg, "allow_spinning", "0").strip().lower() in ("1", "true") else "0"
            opts.add_session_config_entry("session.intra_op.allow_spinning", spinning)
            if spinning == "1":  # spin inside a run only: stop when it returns, so idle threads steal nothing
                opts.add_session_config_entry("session.force_spinning_stop", "1")
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            self.input_names = [i.name for i in self.session.get_inputs()]
            self.vocab_size = _vocab_size(path)
        elif self.executor != "costmodel":
            raise pb_utils.TritonModelException(
                f"unknown executor {self.executor!r}: use 'onnxruntime' or 'costmodel'")

    def _check(self, ids, mask):
        """Name what is wrong with one request's tensors, so it fails alone and not its batch."""
        if ids.ndim != 2 or ids.shape[1] == 0:
            return f"input_ids must be [batch, seq_len] with seq_len >= 1, got shape {list(ids.shape)}"
        if self.vocab_size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
            return (f"token id {bad} is outside the vocabulary [0, {self.vocab_size}): "
                    "tokenize with the model's tokenizer")
        if mask.min() < 0 or mask.max() > 1:
            return "attention_mask must hold only 0 and 1"
        if (mask.sum(axis=1) == 0).any():
            return "attention_mask has a row with no real token: every text needs at least [CLS]"
        return None

    def _run(self, ids, mask, extra=None):
        if self.session is None:  # the emulated GPU (execute holds its lock) is busy exactly t(B, L)
            deadline = time.perf_counter() + self.cost_a + self.cost_b * ids.shape[0] * ids.shape[1]
            vecs = self.rng.standard_normal((ids.shape[0], self.dim)).astype(np.float32)
            vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
            _wait_until(deadline)
            return vecs
        feeds = {"input_ids": ids, "attention_mask": mask, **(extra or {})}
        return self.session.run([self.output], {k: v for k, v in feeds.items() if k in self.input_names})[0]

    def finalize(self):
        if self.run_lock is not None:
            self.run_lock.close()

    def execute(self, requests):
        responses = [None] * len(requests)
        groups = {}
        for i, request in enumerate(requests):
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            if ids.shape != mask.shape:
                responses[i] = pb_utils.InferenceResponse(error=_input_error(
                    f"input_ids shape {list(ids.shape)} != attention_mask shape {list(mask.shape)}"))
                continue
            problem = self._check(ids, mask)
            if problem:
                responses[i] = pb_utils.InferenceResponse(error=_input_error(problem))
                continue
            extra = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy().astype(np.int64, copy=False)
                     for name in self.extra_inputs}
            groups.setdefault(ids.shape[1], []).append((i, ids, mask, extra))
        if self.run_lock is not None:  # the GPU (or the cores) for the whole Triton batch: batches never interleave
            fcntl.flock(self.run_lock, fcntl.LOCK_EX)
        try:
            self._run_groups(groups, responses)
        finally:
            if self.run_lock is not None:
                fcntl.flock(self.run_lock, fcntl.LOCK_UN)
        return responses

    def _run_groups(self, groups, responses):
        """One run per sequence length; fills `responses`."""
        for items in groups.values():
            if len(items) == 1:  # one request (e.g. one planned sub-batch of the text endpoint): no copy
                ids, mask = items[0][1].astype(np.int64, copy=False), items[0][2].astype(np.int64, copy=False)
                extra = items[0][3]
            else:
                ids = np.concatenate([it[1] for it in items]).astype(np.int64, copy=False)
                mask = np.concatenate([it[2] for it in items]).astype(np.int64, copy=False)
                extra = {name: np.concatenate([it[3][name] for it in items]) for name in self.extra_inputs}
            try:
                out = self._run(ids, mask, extra).astype(np.float32, copy=False)
            except Exception as exc:  # ORT raises its own types (e.g. index out of range): answer, don't crash
                for i, *_ in items:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"encoder failed on batch {list(ids.shape)}: {exc}"))
                continue
            start = 0
            for i, req_ids, *_ in items:
                n = req_ids.shape[0]
                rows = out[start:start + n]
                start += n
                if self.fault_token and (req_ids == self.fault_token).any():
                    if self.fault == "raise":
                        responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            f"injected fault: token {self.fault_token}"))
                        continue
                    rows = np.ascontiguousarray(rows[:, :-1])
                responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor(self.output, rows)])
