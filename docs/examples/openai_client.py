# OpenAI's Python client against the gateway (pip install openai). With `docker compose up -d` on this host:
#   export BGE_GATEWAY_KEY=$(docker compose exec -T gateway cat /secrets/gateway_key)
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("BGE_GATEWAY_URL", "http://127.0.0.1:8080") + "/v1",
                api_key=os.environ["BGE_GATEWAY_KEY"])
response = client.embeddings.create(model="bge_large_zh", input=["检索增强生成", "向量数据库"])
print(len(response.data), "vectors of", len(response.data[0].embedding), "dims,",
      response.usage.prompt_tokens, "tokens")
