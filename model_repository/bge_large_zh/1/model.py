"""Text endpoint of the kit (Triton python backend): text in, normalised embedding out.

A thin adapter over the pure stages beside it (text_stages.py, text_core.py): one Triton batch of
requests (each `text` BYTES [n, 1]) is decoded, tokenized at once, sorted by length, cut into
sub-batches under a token budget, padded to a multiple of 8 and sent to the encoder model through
BLS (async_exec when sub-batches overlap, at most `max_in_flight` at the encoder), then scattered
back, one response per request. A bad request gets its own error response; the rest of the batch
is not touched. Error kinds map to Triton codes in one place, text_core.triton_code.

Parameter `encoder` "bls" (the default) is the deployment. Any other value X loads the backend
module encoder_X.py beside this file: the local CPU variant (server/cpu_variant.py) renders one
there; this file runs unchanged in both.
"""
import importlib
import json
import os
import time

import triton_python_backend_utils as pb_utils

# The python backend stub appends this model's version directory (the folder of model.py) and the
# model directory to sys.path before it imports `<version>.model` (python_backend r24.10,
# src/pb_stub.cc, ModelContext::StubSetup), so the modules beside this file import by name.
from text_core import EncoderBackend, TextError, TextSettings, encoder_error, triton_code
from text_stages import TextPipeline, Tokenizers


class BlsBackend(EncoderBackend):
    """The encoder model reached through BLS (exec, or async_exec for overlapped sub-batches)."""

    overlaps = True

    def __init__(self, model: str) -> None:
        self.model = model

    def run(self, ids, mask):
        return self._result(self._request(ids, mask).exec())

    async def arun(self, ids, mask):
        return self._result(await self._request(ids, mask).async_exec())

    def _request(self, ids, mask):
        return pb_utils.InferenceRequest(
            model_name=self.model, requested_output_names=["embedding"],
            inputs=[pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)],
            preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0))

    def _result(self, response):
        if response.has_error():
            error = response.error()
            raise encoder_error(self.model, error.message(), error.code() == pb_utils.TritonError.UNAVAILABLE)
        tensor = pb_utils.get_output_tensor_by_name(response, "embedding")
        if not tensor.is_cpu():  # preferred_memory asks for CPU: the server image carries no GPU array library
            raise encoder_error(self.model, "answered 'embedding' in GPU memory although the request asked for "
                                "CPU memory (preferred_memory): check the encoder's output placement", False)
        return tensor.as_numpy()


def _triton_error(error: TextError):
    """A TritonError with the code that text_core.triton_code gives the error's kind."""
    return pb_utils.TritonError(error.message, getattr(pb_utils.TritonError, triton_code(error)))


def _backend(settings: TextSettings, cfg: dict, args: dict) -> EncoderBackend:
    if settings.encoder == "bls":
        return BlsBackend(settings.onnx_model)
    name = f"encoder_{settings.encoder}"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise pb_utils.TritonModelException(
            f"parameter encoder={settings.encoder!r} needs {name}.py beside model.py ({exc}): use 'bls', or a "
            "repository rendered by `python -m bge_triton.server up`") from exc
    return module.make_backend(settings, cfg, args)


class TritonPythonModel:
    """Decode, tokenize, plan, run, scatter (text_stages) with BLS to the encoder."""

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        try:
            self.settings = TextSettings.from_params(params, cfg["name"])
            version_dir = os.path.join(args["model_repository"], args["model_version"])
            tok = Tokenizers.from_dir(os.path.join(version_dir, self.settings.tokenizer_dir),
                                      self.settings.max_length)
            self.backend = _backend(self.settings, cfg, args)
        except (ValueError, FileNotFoundError) as exc:
            raise pb_utils.TritonModelException(f"{cfg['name']}: {exc}") from exc
        self.pipeline = TextPipeline(self.settings, tok, self.backend, int(cfg["output"][0]["dims"][-1]))
        self._metrics(cfg["name"])

    def _metrics(self, model):
        labels = {"model": model}
        self.families = []  # a MetricFamily must outlive its Metric objects

        def counter(name, description):
            self.families.append(pb_utils.MetricFamily(name=name, description=description,
                                                       kind=pb_utils.MetricFamily.COUNTER))
            return self.families[-1].Metric(labels=labels)

        self.counters = {
            "real": counter("kit_real_tokens_total", "Real (unpadded) tokens encoded"),
            "padded": counter("kit_padded_tokens_total",
                              "Tokens sent to the encoder after padding (padding ratio = padded / real)"),
            "batches": counter("kit_text_batches_total", "Triton batches executed by the text endpoint"),
            "texts": counter("kit_texts_total", "Texts embedded (tokens per batch = real tokens / batches)"),
            "subs": counter("kit_sub_batches_total", "Encoder sub-batches (per batch = sub_batches / batches)"),
            "bad": counter("kit_rejected_requests_total", "Requests answered with an input error"),
        }
        # Each increment is a round trip from this stub to the server (about 50 us), so counts are summed
        # here and sent together at most every metrics_flush_s (and at unload): ratios stay exact.
        self.pending = dict.fromkeys(self.counters, 0)
        self.last_flush = float("-inf")

    def _flush_metrics(self, force=False):
        now = time.monotonic()
        if not force and now - self.last_flush < self.settings.metrics_flush_s:
            return
        self.last_flush = now
        for key, value in self.pending.items():
            if value:
                self.counters[key].increment(value)
                self.pending[key] = 0

    def finalize(self):
        self._flush_metrics(force=True)
        self.backend.close()

    def execute(self, requests):
        """Answer one Triton batch: the responses, or a coroutine when BLS sub-batches overlap.

        The python backend awaits a returned coroutine on its event loop; a plain list skips that
        hand-off, so a single sub-batch, max_in_flight 1 and in-process encoding stay synchronous.
        """
        batch = self.pipeline.encode_pre([(pb_utils.get_input_tensor_by_name(r, "text").as_numpy(),
                                           r.parameters()) for r in requests])
        if self.pipeline.overlapped(batch):
            return self._execute_overlapped(batch)
        if batch.plans:
            self.pipeline.encode_core(batch)
        return self._respond(batch)

    async def _execute_overlapped(self, batch):
        await self.pipeline.encode_core_async(batch)
        return self._respond(batch)

    def _respond(self, batch):
        self.pending["bad"] += batch.rejected
        if batch.plans:
            for key, value in (("real", batch.real_tokens), ("padded", batch.padded_tokens), ("batches", 1),
                               ("texts", len(batch.ids) - len(batch.row_errors)), ("subs", len(batch.plans))):
                self.pending[key] += value
        responses = []
        for result in self.pipeline.encode_post(batch):
            if isinstance(result, TextError):
                responses.append(pb_utils.InferenceResponse(error=_triton_error(result)))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", result)]))
        self._flush_metrics()
        return responses
