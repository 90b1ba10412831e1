"""Text-pair endpoint of the kit's reranker (Triton python backend): one query and N documents in, one relevance
logit per document out.

The embedder's text endpoint with other first stages: this model subclasses its TritonPythonModel (text_model.py,
a copy of bge_large_zh/1/model.py) and reuses its scheduler unchanged, so every guarantee holds here too: one
answer per request on every path, admission per priority level, timeouts, cancellation, the timing output, the
kit_* metrics. Each pair is one text of the length-aware scheduler (rerank_stages.py tokenizes them); the encoder
(NAME_onnx, a cross-encoder graph with output `score` [B, 1]) is reached through BLS, or in process on the local
CPU variant (parameter `encoder`). Outputs per request: `score` [1, N], `token_count` [1, N], `timing_us` [1, 3].
Parameter `token_types` "true": the encoder reads token_type_ids (BERT cross-encoders); they travel packed in the
ids (rerank_stages.unpack).
"""
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from rerank_stages import PairTokenizers, RerankPipeline, unpack
from text_core import EncoderBackend, truthy
from text_model import BlsBackend, _backend
from text_model import TritonPythonModel as TextModel

OUTPUTS = ("score", "token_count", "timing_us")  # config.pbtxt's outputs, in its order
ENCODER_OUTPUT = "score"


class PairBackend(EncoderBackend):
    """The encoder backend with the token types unpacked from the ids (and passed on where the model reads them)."""

    def __init__(self, inner: EncoderBackend, token_types: bool) -> None:
        self.inner, self.token_types = inner, token_types

    def run(self, ids, mask):
        ids, types = unpack(ids)
        if self.token_types:
            return self.inner.run(ids, mask, token_type_ids=types)
        return self.inner.run(ids, mask)

    def hold(self):
        return self.inner.hold()

    def close(self) -> None:
        self.inner.close()


class TritonPythonModel(TextModel):
    """The text endpoint's adapter with the reranker's inputs, outputs and first stages."""

    OUTPUTS = OUTPUTS

    def _setup(self, cfg, args, params):
        token_types = truthy(params.get("token_types", "false"))
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        tok = PairTokenizers.from_dir(os.path.join(version_dir, self.settings.tokenizer_dir),
                                      self.settings.max_length, token_types)
        inner = BlsBackend(self.settings.onnx_model, ENCODER_OUTPUT) if self.settings.encoder == "bls" \
            else _backend(self.settings, cfg, args)
        self.backend = PairBackend(inner, token_types)
        self.pipeline = RerankPipeline(self.settings, tok)
        return tok.pad_id, 1  # one logit per pair

    @staticmethod
    def _inputs(request):
        return (pb_utils.get_input_tensor_by_name(request, "query").as_numpy(),
                pb_utils.get_input_tensor_by_name(request, "documents").as_numpy(), request.parameters())

    @staticmethod
    def _arrays(result):
        return {"score": lambda: result.out.reshape(1, -1), "token_count": lambda: result.tokens.reshape(1, -1),
                "timing_us": lambda: np.array([result.timing_us()], np.int64)}
