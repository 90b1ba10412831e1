"""RAG-framework adapters over the kit's SDK (no gateway hop): LangChain (extra `langchain`) and
LlamaIndex (extra `llamaindex`). Import the submodule you need:

    from bge_triton.integrations.langchain import BgeTritonEmbeddings
    from bge_triton.integrations.llama_index import BgeTritonEmbedding
    from bge_triton.integrations.langchain_rerank import BgeTritonRerank      # document compressor (reranker)
    from bge_triton.integrations.llama_index_rerank import BgeTritonRerank    # node postprocessor (reranker)
"""
