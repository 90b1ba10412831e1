# The kit's SDK straight to Triton over gRPC (pip install bge-triton-kit): passages as they are, queries with
# BGE's retrieval instruction; vectors are L2-normalised, so a dot product is the cosine similarity.
import os

from bge_triton.client import EmbeddingClient

with EmbeddingClient(os.environ.get("BGE_TRITON_URL", "127.0.0.1:8001"), model="bge_large_zh") as client:
    passages = client.embed_documents(["Triton 的动态批处理把并发请求合成一批", "今天天气很好"])
    query = client.embed_queries(["什么是动态批处理？"])[0]
print("shape", passages.shape, "similarity", (passages @ query).round(3).tolist())
