"""Text endpoint of the kit (Triton python backend): text in, normalised embedding out.

A thin adapter over the pure stages beside it (text_stages.py, text_scheduler.py, text_core.py):
execute() decodes and tokenizes one Triton batch (each request's `text` BYTES [n, 1]) and hands the
texts to this instance's scheduler, then returns at once; the scheduler's dispatcher threads cut
sub-batches of similar lengths from every text waiting, send them to the encoder model through BLS,
and answer each request through its response sender as soon as its last text is embedded (default
mode, python_backend r24.06+). Outputs: `embedding`, `token_count` (tokens per text as embedded, after
truncation) and `timing_us` (where the time went: docs/reliability.md, "Request parameters and timing"),
each computed and sent only when the request asks for it. Request parameter `truncation_direction`
("right" = cut the end, the default; "left" = cut the start) picks the side a too-long text loses.
A bad request gets its own error response; the rest of the batch is not touched. Error kinds map to
Triton codes in one place, text_core.triton_code. Request parameter `priority` (the SDK sends Triton's
priority level here too, as `priority_level`: the python backend cannot read it) puts queries ahead.

Parameter `encoder` "bls" (the default) is the deployment. Any other value X loads the backend
module encoder_X.py beside this file: the local CPU variant (server/cpu_variant.py) renders one
there; this file runs unchanged in both.
"""
import contextlib
import ctypes
import faulthandler
import gc
import importlib
import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

# The python backend stub appends this model's version directory (the folder of model.py) and the
# model directory to sys.path before it imports `<version>.model` (python_backend r24.10,
# src/pb_stub.cc, ModelContext::StubSetup), so the modules beside this file import by name.
from text_core import EncoderBackend, TextError, TextSettings, encoder_error, triton_code
from text_scheduler import QueryMarker, QueuePolicy, Scheduler
from text_stages import TextPipeline, Tokenizers

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUTS = ("embedding", "token_count", "timing_us")  # config.pbtxt's outputs, in its order


class BlsBackend(EncoderBackend):
    """The encoder model reached through BLS (exec, from the scheduler's dispatcher threads); `output` is the
    encoder's output (the reranker's model.py, beside a copy of this file, asks for `score`)."""

    def __init__(self, model: str, output: str = "embedding") -> None:
        self.model, self.output = model, output

    def run(self, ids, mask, **extra):
        return self._result(self._request(ids, mask, **extra).exec())

    def _request(self, ids, mask, **extra):
        inputs = [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)]
        inputs += [pb_utils.Tensor(name, value) for name, value in extra.items()]
        return pb_utils.InferenceRequest(
            model_name=self.model, requested_output_names=[self.output], inputs=inputs,
            preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0))

    def _result(self, response):
        if response.has_error():
            error = response.error()
            raise encoder_error(self.model, error.message(), error.code() == pb_utils.TritonError.UNAVAILABLE)
        tensor = pb_utils.get_output_tensor_by_name(response, self.output)
        if not tensor.is_cpu():  # preferred_memory asks for CPU: the server image carries no GPU array library
            raise encoder_error(self.model, f"answered {self.output!r} in GPU memory although the request asked "
                                "for CPU memory (preferred_memory): check the encoder's output placement", False)
        return tensor.as_numpy()


def _triton_error(error: TextError):
    """A TritonError with the code that text_core.triton_code gives the error's kind."""
    return pb_utils.TritonError(error.message, getattr(pb_utils.TritonError, triton_code(error)))


def _keep_until_exit(objects) -> None:
    """One reference more to each object, never given back: it is not deleted before its process exits (and the
    stub then sends no delete request). For the metric objects (TritonPythonModel.finalize)."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _log(message: str) -> None:
    """To the server's log (pb_utils.Logger, python_backend r23.04+)."""
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_error(message)


def _cancelled(job) -> bool:
    """Whether the client cancelled the job's request (r24.10: InferenceResponseSender.is_cancelled, a round trip
    to the server; the request object is not used after execute returns)."""
    return bool(job.context[0].is_cancelled())


def _timeout_s(request) -> float:
    """The request's own timeout (Triton's `timeout` request field, microseconds; 0 = none)."""
    timeout = getattr(request, "timeout", None)
    return (timeout() or 0) / 1e6 if timeout is not None else 0.0


def _backend(settings: TextSettings, cfg: dict, args: dict) -> EncoderBackend:
    if settings.encoder == "bls":
        return BlsBackend(settings.onnx_model)
    name = f"encoder_{settings.encoder}"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise pb_utils.TritonModelException(
            f"parameter encoder={settings.encoder!r} needs {name}.py beside model.py ({exc}): use 'bls', or a "
            "repository rendered by `bge-triton serve up`") from exc
    return module.make_backend(settings, cfg, args)


class TritonPythonModel:
    """Decode and tokenize (text_stages), then the scheduler plans, runs through BLS and answers.

    The reranker's model.py subclasses it (a copy of this file beside it, as text_model.py) through the hooks
    OUTPUTS, _setup, _inputs and _arrays."""

    OUTPUTS = OUTPUTS

    def initialize(self, args):
        if not faulthandler.is_enabled():  # a crash of this stub prints every Python thread's stack to the server log
            faulthandler.enable()
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        try:
            self.settings = TextSettings.from_params(params, cfg["name"])
            pad_id, dim = self._setup(cfg, args, params)
        except (ValueError, FileNotFoundError) as exc:
            raise pb_utils.TritonModelException(f"{cfg['name']}: {exc}") from exc
        # requests without a `priority` parameter take the config's default level, as in Triton's queue
        self.default_priority = int(cfg.get("dynamic_batching", {}).get("default_priority_level", 0) or 0)
        self._metrics(cfg["name"])
        self.scheduler = Scheduler(self.settings, self.backend, pad_id, dim, self._answer, QueryMarker(cfg["name"]),
                                   policy=QueuePolicy.from_config(cfg),  # the queue policies hold in the pool
                                   cancelled=_cancelled, log=_log)
        self.flusher = threading.Thread(target=self._flush_loop, name="kit-metrics", daemon=True)
        self.flusher.start()

    def _setup(self, cfg, args, params):
        """Tokenizer, encoder backend and first stages (self.backend, self.pipeline); returns (pad id, the
        encoder's output width)."""
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        tok = Tokenizers.from_dir(os.path.join(version_dir, self.settings.tokenizer_dir), self.settings.max_length)
        self.backend = _backend(self.settings, cfg, args)
        self.pipeline = TextPipeline(self.settings, tok)
        return tok.pad_id, int(cfg["output"][0]["dims"][-1])

    @staticmethod
    def _inputs(request):
        """What the pipeline's encode_pre takes of one request."""
        return pb_utils.get_input_tensor_by_name(request, "text").as_numpy(), request.parameters()

    @staticmethod
    def _arrays(result):
        """Each output's array of a finished job, built only when asked for."""
        return {"embedding": lambda: result.out, "token_count": lambda: result.tokens.reshape(-1, 1),
                # the request's (tokenization, queue, inference) microseconds, the same on each of its rows
                "timing_us": lambda: np.tile(np.array(result.timing_us(), np.int64), (result.rows, 1))}

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
            "queued": counter("kit_queue_requests_total", "Requests whose texts all left the scheduler's pool for "
                              "the encoder"),
            "queue_us": counter("kit_queue_duration_us_total", "Microseconds those requests waited in the pool "
                                "(the text endpoint's queue time: Triton's own stays near 0)"),
        }
        # Each increment is a round trip from this stub to the server (about 50 us), so counts are summed
        # here and sent every metrics_flush_s by a thread of their own (and at unload): the request path
        # pays none of them, and ratios stay exact.
        self.pending = dict.fromkeys(("batches", "bad"), 0)
        self.flush_lock = threading.Lock()
        self.stopping = threading.Event()

    def _flush_metrics(self):
        with self.flush_lock:
            counts = {**self.scheduler.counters.take(), **self.pending}
            self.pending = dict.fromkeys(self.pending, 0)
        for key, value in counts.items():
            if value:
                self.counters[key].increment(value)

    def _flush_loop(self):
        while not self.stopping.wait(max(self.settings.metrics_flush_s, 0.01)):
            self._flush_metrics()

    def finalize(self):
        self.scheduler.close()
        self.stopping.set()
        self.flusher.join(5)
        if self.flusher.is_alive():
            _log("text endpoint: the metrics flusher did not stop within 5 s")
        self._flush_metrics()
        self.backend.close()
        # The metrics are never deleted: the server shares them with the next instance. Triton 2.51 keeps one
        # prometheus counter per metric name and labels; every instance's MetricFamily (a reload's new one, or
        # the model's other instance) gets that same counter, and each family counts its own references only
        # (core src/metric_family.cc, MetricFamily::Remove). A delete here destroyed the counter the new
        # instance, loaded before this one is finalized, still increments: a write into freed memory of the
        # tritonserver process, which then aborted (malloc(): unaligned fastbin chunk detected, Signal (6)) or
        # went on half-alive, ready but answering nothing (tests/integration/test_text_reload.py). So they
        # stay alive until this stub exits (then nothing is sent, and the counter keeps counting across
        # reloads, as a Prometheus counter should); their delete left to the interpreter's last collection
        # would also come too late (a segfault in Metric::SaveToSharedMemory after the stub's shared memory
        # is gone). Every other pb_utils object still alive is freed now, while the stub runs, by one collection:
        # the response senders of the jobs the scheduler dropped at close (a sender that asked is_cancelled()
        # holds shared memory: freed at the stub's exit it segfaulted, "Garbage-collecting"), and any tensor or
        # response kept by a cycle through an exception's traceback.
        _keep_until_exit([*self.counters.values(), *self.families])
        self.counters.clear()
        self.families.clear()
        gc.collect()

    def execute(self, requests):
        """Tokenize one Triton batch, answer its bad requests, queue the rest; the scheduler answers them.

        Every request gets exactly one response on every path: by the returned list (inline run, or a fault
        before any sender was taken), else through its sender (here for errors, by the scheduler for the rest)."""
        senders: list = []  # (sender, its job | None = not queued | False = answered) once senders are taken
        try:
            return self._execute(requests, senders)
        except Exception as exc:
            _log(f"text endpoint: execute caught {type(exc).__name__}: {exc}")
            message = f"text endpoint failed on this batch: {type(exc).__name__}: {exc}"
            if not senders:
                return [pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL))
                        for _ in requests]
            for sender, job in senders:
                if job is None or (job is not False and self.scheduler.claim(job)):  # not answered yet
                    with job.guard if job else contextlib.nullcontext():  # no is_cancelled() check meanwhile
                        self._send(sender, pb_utils.InferenceResponse(
                            error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)))
            return None

    def _execute(self, requests, taken: list):
        batch = self.pipeline.encode_pre([self._inputs(r) for r in requests])
        with self.flush_lock:
            self.pending["batches"] += 1
            self.pending["bad"] += batch.rejected
        slot_of = {r: k for k, (r, _, _) in enumerate(batch.slots)}
        jobs = [(self.scheduler.new_job(n, batch.priorities[r] or self.default_priority,
                                        timeout_s=_timeout_s(requests[r])),
                 batch.ids[start:start + n]) for r, start, n in batch.slots]
        for job, _ in jobs:
            job.tokenize_us = batch.tokenize_us
        wanted = [tuple(r.requested_output_names()) for r in requests]
        if self.scheduler.run_inline(jobs):  # quiet hours: one sub-batch, answered by the return value
            return [self._response(batch.errors[r] or jobs[slot_of[r]][0], wanted[r])[0] for r in range(len(requests))]
        senders = [r.get_response_sender() for r in requests]
        taken.extend((sender, jobs[slot_of[r]][0] if r in slot_of else None) for r, sender in enumerate(senders))
        for r, k in slot_of.items():
            jobs[k][0].context = (senders[r], wanted[r])
        for r, (sender, error) in enumerate(zip(senders, batch.errors, strict=True)):
            if error is not None:
                taken[r] = (sender, False)  # answered here: never again
                self._send(sender, self._response(error)[0])
        self.scheduler.submit(jobs)
        return None

    @staticmethod
    def _send(sender, response) -> bool:
        """One final response; a send that raises (r24.10: a closed sender, no shared memory) is logged."""
        try:
            sender.send(response, flags=FINAL)
            return True
        except Exception as exc:
            _log(f"text endpoint: sending a response raised {type(exc).__name__}: {exc}")
            return False

    def _response(self, result, wanted=()):
        """The response of a TextError, or of a finished job (the outputs in `wanted`, the request's requested
        output names; none named = all, as Triton fills them in), and its output tensors."""
        error = result if isinstance(result, TextError) else result.error
        if error is not None:
            return pb_utils.InferenceResponse(error=_triton_error(error)), []
        arrays = self._arrays(result)
        tensors = [pb_utils.Tensor(name, arrays[name]()) for name in self.OUTPUTS if not wanted or name in wanted]
        return pb_utils.InferenceResponse(tensors), tensors

    def _answer(self, job):
        """Send one request's response (from a dispatcher thread, or from submit when it is refused).

        Only the outputs the request asked for, and their tensors referenced here until send() returns:
        python_backend r24.10 (Triton 2.51) prunes the outputs a request did not ask for inside send() with
        the GIL released (src/response_sender.cc, PruneOutputTensors), so a tensor held by the response alone
        (the SDK asks for `embedding` only: `token_count` was pruned) freed its numpy array without the GIL
        while the other threads ran - a corrupted Python heap, a stub segfault under load (pymalloc_alloc),
        "Stub process ... is not healthy". Fixed upstream in python_backend #390 (Triton 24.12)."""
        sender, wanted = job.context
        try:
            response, tensors = self._response(job, wanted)
        except Exception as exc:
            response, tensors = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"text endpoint could not build its response: {type(exc).__name__}: {exc}",
                pb_utils.TritonError.INTERNAL)), []
        if not self._send(sender, response) and tensors:
            # the embeddings could not go (e.g. no shared memory for them): a small error response may
            self._send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "text endpoint could not send its response (see the server log); retry",
                pb_utils.TritonError.INTERNAL)))
        del response, tensors  # dropped here, with the GIL
