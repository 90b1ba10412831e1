"""Text endpoint of the kit (Triton python backend): text in, normalised embedding out.

One Triton batch of requests (each request: `text` BYTES [n, 1]) is tokenized at once, sorted by
length, cut into sub-batches under a token budget (B x padded L <= budget, B <= sub_batch_max),
padded to a multiple of 8, and sent to the encoder model through BLS with async_exec so the
sub-batches overlap (at most `max_in_flight` queued at the encoder, so its batcher cannot merge them
back past the token budget). Results go back in order, one response per request. A bad request gets its
own error response; the other requests of the batch are not touched.

Parameter `encoder`: "bls" (default, the GPU deployment: the encoder model on the onnxruntime backend) or
"inprocess" (set by the local CPU variant: this process runs the encoder's model.onnx with ONNX Runtime,
so a CPU request crosses one python stub instead of two; the encoder model stays loaded for tensor mode).
"""
import asyncio
import fcntl
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


def _param(cfg, key, default):
    return cfg.get("parameters", {}).get(key, {}).get("string_value", default)


def _truthy(value):
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() not in ("false", "0", "no", "off")


def plan_sub_batches(lengths, budget, max_batch, multiple, overhead_tokens=64):
    """Length-aware split of one Triton batch into encoder sub-batches, optimal by DP.

    Texts are sorted by length; contiguous runs become sub-batches padded to the run's longest
    (rounded up to `multiple`). Cost of a run = B x padded_L + overhead_tokens (the fixed cost of
    one encoder call, in token units); constraints B <= max_batch and B x padded_L <= budget (a
    lone text longer than the budget still gets its own run). Returns [(indices, padded_len)].
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    pads = [-(-lengths[i] // multiple) * multiple for i in order]
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: cheapest split of the j shortest texts
        pad = pads[j - 1]
        for i in range(j - 1, -1, -1):  # run = order[i:j], padded to pads[j-1]
            size = j - i
            if size > max_batch or (size > 1 and size * pad > budget):
                break
            cost = best[i] + size * pad + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    plans, j = [], n
    while j > 0:
        i = cut[j]
        plans.append((order[i:j], pads[j - 1]))
        j = i
    return plans[::-1]


def _error(message, code=None):
    """A TritonError with `code` (default INVALID_ARG: a bad request)."""
    try:
        return pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG if code is None else code)
    except (AttributeError, TypeError):  # older python_backend without error codes
        return pb_utils.TritonError(message)


def _cpu_lock(cfg, args):
    """The repository's CPU lock file (parameter cpu_lock "1"), or None.

    ONNX Runtime on CPU uses every core for one run, so two instances must not run at once; with the
    lock, a second instance still takes requests off the queue while the first runs (Triton's batcher
    then never leaves a request waiting for a busy single instance) and tokenizes them, but its runs
    wait for the cores. The lock is held for a whole Triton batch, so the sub-batches of two batches do
    not interleave (that would delay both). Every model of the CPU variant that runs ORT shares this file.
    """
    if not _truthy(_param(cfg, "cpu_lock", "0")):
        return None
    root = os.path.dirname(os.path.normpath(args["model_repository"]))
    return open(os.path.join(root, ".cpu_compute.lock"), "a+")


class EncoderError(RuntimeError):
    """The encoder answered an error; `code` is its TritonError code (None if unknown)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class TritonPythonModel:
    """Tokenize, length-aware sub-batching, BLS to the encoder, scatter back."""

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        tok_dir = os.path.join(version_dir, _param(cfg, "tokenizer_dir", "tokenizer"))
        tok_file = os.path.join(tok_dir, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise pb_utils.TritonModelException(
                f"{tok_file} is missing: run `python -m bge_triton.export --repository <repo> --name {cfg['name']}`")
        self.encoder = _param(cfg, "onnx_model", cfg["name"] + "_onnx")
        self.max_length = int(_param(cfg, "max_length", "512"))
        self.budget = int(_param(cfg, "token_budget", "8192"))
        self.multiple = max(1, int(_param(cfg, "pad_to_multiple", "8")))
        self.sub_batch_max = int(_param(cfg, "sub_batch_max", "64"))
        self.overhead_tokens = int(_param(cfg, "split_overhead_tokens", "64"))
        # Sub-batches queued at the encoder at once. 2 keeps the encoder busy (one runs, one waits)
        # without letting its dynamic batcher merge equal-shape sub-batches past the token budget.
        self.max_in_flight = max(1, int(_param(cfg, "max_in_flight", "2")))
        self.dim = int(cfg["output"][0]["dims"][-1])
        self.mode = _param(cfg, "encoder", "bls").strip().lower()
        self.session = None
        self.cpu_lock = None
        if self.mode == "inprocess":
            self.session = self._load_session(cfg, args)
            self.cpu_lock = _cpu_lock(cfg, args)
        elif self.mode != "bls":
            raise pb_utils.TritonModelException(f"parameter encoder={self.mode!r}: use 'bls' or 'inprocess'")
        self.full = Tokenizer.from_file(tok_file)  # no truncation: exact counts for truncate=false
        self.full.no_truncation()
        self.full.no_padding()
        self.trunc = Tokenizer.from_file(tok_file)
        self.trunc.no_padding()
        self.trunc.enable_truncation(self.max_length)
        self.pad_id = self.full.token_to_id("[PAD]") or 0
        self.flush_s = float(_param(cfg, "metrics_flush_s", "0.25"))
        self._metrics(cfg["name"])

    def _load_session(self, cfg, args):
        """ONNX Runtime session on the encoder model's newest version (encoder=inprocess)."""
        import onnxruntime as ort

        encoder_dir = os.path.join(os.path.dirname(args["model_repository"].rstrip(os.sep)), self.encoder)
        versions = sorted((int(v) for v in os.listdir(encoder_dir) if v.isdigit()), reverse=True) \
            if os.path.isdir(encoder_dir) else []
        paths = [os.path.join(encoder_dir, str(v), "model.onnx") for v in versions]
        path = next((p for p in paths if os.path.isfile(p)), None)
        if path is None:
            raise pb_utils.TritonModelException(
                f"encoder=inprocess needs {encoder_dir}/<version>/model.onnx: run `python -m bge_triton.export` first")
        opts = ort.SessionOptions()
        threads = int(_param(cfg, "intra_op_threads", "0"))
        if threads > 0:
            opts.intra_op_num_threads = threads
        spinning = "1" if _truthy(_param(cfg, "allow_spinning", "0")) else "0"
        opts.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        if spinning == "1":  # spin inside a run only: stop when it returns, so idle threads steal nothing
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.session_inputs = {i.name for i in session.get_inputs()}
        return session

    def _metrics(self, model):
        counter = pb_utils.MetricFamily.COUNTER
        labels = {"model": model}
        self.families = []  # a MetricFamily must outlive its Metric objects

        def fam(name, description):
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=counter))
            return self.families[-1]

        self.m_real = fam("kit_real_tokens_total", "Real (unpadded) tokens encoded").Metric(labels=labels)
        self.m_padded = fam("kit_padded_tokens_total",
                            "Tokens sent to the encoder after padding (padding ratio = padded / real)"
                            ).Metric(labels=labels)
        self.m_batches = fam("kit_text_batches_total", "Triton batches executed by the text endpoint"
                             ).Metric(labels=labels)
        self.m_texts = fam("kit_texts_total", "Texts embedded (tokens per batch = real tokens / batches)"
                           ).Metric(labels=labels)
        self.m_subs = fam("kit_sub_batches_total", "Encoder sub-batches (per batch = sub_batches / batches)"
                          ).Metric(labels=labels)
        self.m_bad = fam("kit_rejected_requests_total", "Requests answered with an input error"
                         ).Metric(labels=labels)
        # Each increment is a round trip from this stub to the server (about 50 us), so counts are summed
        # here and sent at most every metrics_flush_s (and at unload): five round trips per batch cost
        # 0.28 ms of a single text's latency. All counters are sent together, so ratios stay exact.
        self.pending = {m: 0 for m in (self.m_real, self.m_padded, self.m_batches, self.m_texts, self.m_subs,
                                       self.m_bad)}
        self.last_flush = float("-inf")

    def _count(self, metric, value):
        self.pending[metric] += value

    def _flush_metrics(self, force=False):
        now = time.monotonic()
        if not force and now - self.last_flush < self.flush_s:
            return
        self.last_flush = now
        for metric, value in self.pending.items():
            if value:
                metric.increment(value)
                self.pending[metric] = 0

    def finalize(self):
        self._flush_metrics(force=True)
        if self.cpu_lock is not None:
            self.cpu_lock.close()

    def _texts_of(self, request):
        """Decode one request's texts; return (list of str, truncate flag) or raise ValueError."""
        tensor = pb_utils.get_input_tensor_by_name(request, "text")
        raw = tensor.as_numpy().reshape(-1)
        params = json.loads(request.parameters() or "{}")
        truncate = _truthy(params.get("truncate", True))
        texts = []
        for j, item in enumerate(raw):
            if isinstance(item, str):
                text = item
            else:
                try:
                    text = bytes(item).decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"text {j} is not valid UTF-8 ({exc.reason} at byte {exc.start}): "
                                     "send UTF-8 encoded text") from None
            if "\x00" in text:
                raise ValueError(f"text {j} contains a NUL byte: remove control characters")
            if not text.strip():
                raise ValueError(f"text {j} is empty or whitespace only: send at least one visible character")
            texts.append(text)
        return texts, truncate

    def execute(self, requests):
        """Answer one Triton batch. Returns the responses, or a coroutine when sub-batches overlap.

        The python backend awaits a returned coroutine on its event loop; a plain list skips that
        hand-off, so in-process encoding, a single sub-batch and max_in_flight 1 stay synchronous.
        """
        responses, slots, all_ids = self._prepare(requests)
        if not all_ids:
            self._flush_metrics()
            return responses
        lengths = [len(ids) for ids in all_ids]
        plans = plan_sub_batches(lengths, self.budget, self.sub_batch_max, self.multiple, self.overhead_tokens)
        if self.session is None and len(plans) > 1 and self.max_in_flight > 1:
            return self._execute_overlapped(responses, slots, all_ids, lengths, plans)
        out = np.empty((len(all_ids), self.dim), dtype=np.float32)
        if self.cpu_lock is not None:  # the cores for this whole Triton batch: batches never interleave
            fcntl.flock(self.cpu_lock, fcntl.LOCK_EX)
        try:
            for rows, pad_len in plans:  # in-process ORT, or one blocking BLS call after another
                ids, mask = self._pad(all_ids, lengths, rows, pad_len)
                if self.session is not None:
                    out[rows] = self._run_inprocess(ids, mask)
                else:
                    out[rows] = self._result(self._request(ids, mask).exec())
        except RuntimeError as exc:
            return self._finish(responses, slots, None, exc)
        finally:
            if self.cpu_lock is not None:
                fcntl.flock(self.cpu_lock, fcntl.LOCK_UN)
        self._count_batch(lengths, plans)
        return self._finish(responses, slots, out)

    async def _execute_overlapped(self, responses, slots, all_ids, lengths, plans):
        """BLS sub-batches with up to max_in_flight queued at the encoder at once."""
        out = np.empty((len(all_ids), self.dim), dtype=np.float32)
        window = asyncio.Semaphore(self.max_in_flight)

        async def run(rows, pad_len):
            ids, mask = self._pad(all_ids, lengths, rows, pad_len)
            async with window:  # at most max_in_flight sub-batches queued at the encoder
                out[rows] = await self._bls(ids, mask)

        try:
            await asyncio.gather(*(run(rows, pad_len) for rows, pad_len in plans))
        except RuntimeError as exc:
            return self._finish(responses, slots, None, exc)
        self._count_batch(lengths, plans)
        return self._finish(responses, slots, out)

    def _prepare(self, requests):
        """Decode and tokenize a Triton batch: (responses with input errors set, slots, token ids)."""
        responses = [None] * len(requests)
        decoded = []  # (request index, texts, truncate)
        for r, request in enumerate(requests):
            try:
                texts, truncate = self._texts_of(request)
            except ValueError as exc:
                responses[r] = self._reject(exc)
                continue
            decoded.append((r, texts, truncate))
        # One encode_batch for every truncating text of the Triton batch (one call, not one per request);
        # a lone text skips encode_batch's thread-pool hand-off.
        flat = [t for _, texts, truncate in decoded if truncate for t in texts]
        if len(flat) == 1:
            trunc_ids = iter([self.trunc.encode(flat[0]).ids])
        else:
            trunc_ids = iter([enc.ids for enc in self.trunc.encode_batch(flat)] if flat else [])
        slots = []  # (request index, first row, count)
        all_ids = []
        for r, texts, truncate in decoded:
            if truncate:
                ids = [next(trunc_ids) for _ in texts]
            else:
                try:
                    ids = [enc.ids for enc in self.full.encode_batch(texts)]
                    for j, row in enumerate(ids):
                        if len(row) > self.max_length:
                            raise ValueError(f"text {j} has {len(row)} tokens, over the limit of "
                                             f"{self.max_length}: shorten it or send truncate=true")
                except ValueError as exc:
                    responses[r] = self._reject(exc)
                    continue
            slots.append((r, len(all_ids), len(ids)))
            all_ids.extend(ids)
        return responses, slots, all_ids

    def _finish(self, responses, slots, vectors, error=None):
        """Fill the responses of the encoded requests (or the encoder's error), send the metrics."""
        for r, start, count in slots:
            if error is not None:
                responses[r] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error)))
            else:
                responses[r] = pb_utils.InferenceResponse(
                    [pb_utils.Tensor("embedding", vectors[start:start + count])])
        self._flush_metrics()
        return responses

    def _reject(self, exc):
        self._count(self.m_bad, 1)
        return pb_utils.InferenceResponse(error=_error(str(exc)))

    def _count_batch(self, lengths, plans):
        self._count(self.m_real, sum(lengths))
        self._count(self.m_padded, sum(len(rows) * pad_len for rows, pad_len in plans))
        self._count(self.m_batches, 1)
        self._count(self.m_texts, len(lengths))
        self._count(self.m_subs, len(plans))

    def _pad(self, all_ids, lengths, rows, pad_len):
        ids = np.full((len(rows), pad_len), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), pad_len), dtype=np.int64)
        for k, i in enumerate(rows):
            ids[k, :lengths[i]] = all_ids[i]
            mask[k, :lengths[i]] = 1
        return ids, mask

    def _run_inprocess(self, ids, mask):
        feeds = {k: v for k, v in (("input_ids", ids), ("attention_mask", mask)) if k in self.session_inputs}
        try:
            return self.session.run(["embedding"], feeds)[0]
        except Exception as exc:  # ORT's own exception types: answer the batch, keep the model up
            raise EncoderError(f"encoder {self.encoder} (in-process) failed on batch {list(ids.shape)}: {exc}") from exc

    async def _bls(self, ids, mask):
        return self._result(await self._request(ids, mask).async_exec())

    def _request(self, ids, mask):
        kwargs = dict(model_name=self.encoder, requested_output_names=["embedding"],
                      inputs=[pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)])
        try:
            kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
        except AttributeError:
            pass  # older python_backend: outputs already come back in CPU memory
        return pb_utils.InferenceRequest(**kwargs)

    def _result(self, response):
        if response.has_error():
            error = response.error()
            try:
                code = error.code()
            except AttributeError:  # older python_backend without error codes
                code = None
            raise EncoderError(f"encoder {self.encoder} failed: {error.message()}", code)
        tensor = pb_utils.get_output_tensor_by_name(response, "embedding")
        if tensor.is_cpu():
            return tensor.as_numpy()
        from torch.utils.dlpack import from_dlpack  # GPU output: only when CPU memory was not honoured

        return from_dlpack(tensor.to_dlpack()).cpu().numpy()
