#!/bin/sh
# The gateway with curl: ready, then two embeddings. Against `docker compose up -d` on this host, with its key:
#   export BGE_GATEWAY_KEY=$(docker compose exec -T gateway cat /secrets/gateway_key)
set -eu
GATEWAY=${BGE_GATEWAY_URL:-http://127.0.0.1:8080}
curl -fsS "$GATEWAY/ready" && echo
curl -fsS "$GATEWAY/v1/embeddings" \
  -H "Authorization: Bearer $BGE_GATEWAY_KEY" \
  -H "Content-Type: application/json" \
  -d '{"model": "bge_large_zh", "input": ["检索增强生成", "向量数据库"]}'
