"""Triton python-backend model of the GPU bench (bench_gpu.py copies it): random-weight BERT in torch, CLS, L2 norm.

Knobs: the config's `parameters`. input_ids [n, L] (INT32/INT64), attention_mask optional (else 0 is padding).
"""
import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import BertConfig, BertModel


def plan_sub_batches(lengths: np.ndarray, padding: str, multiple: int, budget: int) -> list:
    """[(row indices, padded length)] covering every row once. longest: cut to the longest row; as_given: as sent;
    length_aware: sorted rows in sub-batches of <= budget padded tokens, each padded to a multiple of `multiple`."""
    if len(lengths) == 0:
        return []
    if padding != "length_aware":
        return [(np.arange(len(lengths)), None if padding == "as_given" else max(int(lengths.max()), 1))]
    plans: list[tuple[list, int]] = []
    for i in np.argsort(lengths, kind="stable"):  # sorted: a row's padded width is the sub-batch's
        width = max(-(-int(lengths[i]) // multiple) * multiple, multiple)
        if plans and (len(plans[-1][0]) + 1) * width <= budget:
            plans[-1] = ([*plans[-1][0], i], width)
        else:
            plans.append(([i], width))
    return [(np.array(idx), width) for idx, width in plans]


class TritonPythonModel:
    """Random-weight BERT with the configured dims, run in torch (fp16 on CUDA, fp32 on CPU)."""

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.padding, self.multiple, self.budget = p["padding"], int(p["pad_to_multiple"]), int(p["token_budget"])
        self.device = torch.device(p["device"])
        if int(p.get("intra_op_threads", "0")) > 0:  # CPU runs: 1 thread, or small models crawl
            torch.set_num_threads(int(p["intra_op_threads"]))
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[p["dtype"]]
        bert = BertConfig(vocab_size=int(p["vocab"]), hidden_size=int(p["hidden"]), num_hidden_layers=int(p["layers"]),
                          num_attention_heads=int(p["heads"]), intermediate_size=int(p["intermediate"]),
                          max_position_embeddings=int(p["max_positions"]), attn_implementation="sdpa")
        torch.manual_seed(int(p["seed"]))
        with torch.device(self.device):
            model = BertModel(bert, add_pooling_layer=False)
        self.model = model.to(self.dtype).eval()  # type: ignore[arg-type]  # transformers types .to() narrowly
        self.hidden = int(p["hidden"])
        for _ in range(2):  # warm up: allocator, cuBLAS handles and kernels for the largest batch before traffic
            self._encode(np.ones((int(p["warmup_batch"]), int(p["warmup_len"])), dtype=np.int32))

    @torch.inference_mode()
    def _encode(self, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        mask = (ids != 0) if mask is None else mask
        lengths = mask.sum(axis=1)
        out = np.zeros((ids.shape[0], self.hidden), dtype=np.float32)
        for idx, width in plan_sub_batches(lengths, self.padding, self.multiple, self.budget):
            x = torch.from_numpy(np.ascontiguousarray(ids[idx, :width])).to(self.device).long()
            m = torch.from_numpy(np.ascontiguousarray(mask[idx, :width])).to(self.device).long()
            hidden = self.model(input_ids=x, attention_mask=m).last_hidden_state
            cls = torch.nn.functional.normalize(hidden[:, 0].float(), dim=-1)
            out[idx] = cls.cpu().numpy()
        return out

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy() for r in requests]
        masks = [pb_utils.get_input_tensor_by_name(r, "attention_mask") for r in requests]
        width = max(a.shape[1] for a in arrays)  # the batcher joins equal shapes; pad anyway, never fail
        ids = np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays], axis=0)
        mask = None
        if all(m is not None for m in masks):
            mask = np.concatenate([np.pad(m.as_numpy(), ((0, 0), (0, width - a.shape[1])))
                                   for m, a in zip(masks, arrays, strict=False)], axis=0)
        parts = np.split(self._encode(ids, mask), np.cumsum([a.shape[0] for a in arrays])[:-1])
        return [pb_utils.InferenceResponse([pb_utils.Tensor("embedding", part)]) for part in parts]

    def finalize(self):
        self.model = None
