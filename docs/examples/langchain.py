# LangChain embeddings on Triton (pip install 'bge-triton-kit[langchain]'), e.g. for a vector store:
#   FAISS.from_texts(texts, embeddings)
import os

from bge_triton.integrations.langchain import BgeTritonEmbeddings

embeddings = BgeTritonEmbeddings(url=os.environ.get("BGE_TRITON_URL", "127.0.0.1:8001"), model="bge_large_zh")
vectors = embeddings.embed_documents(["检索增强生成", "向量数据库"])
query = embeddings.embed_query("什么是检索增强生成？")
print(len(vectors), "vectors of", len(query), "dims")
embeddings.close()
