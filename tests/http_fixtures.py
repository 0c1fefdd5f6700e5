"""One deployment serving the OpenAI HTTP API, shared by the HTTP test modules."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from sarazmq.config import CacheConfig, DeploymentConfig, EngineConfig, SchedulerConfig
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.procs.launcher import Deployment

API_KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 512
ENGINE = {"chunk_size": 64, "max_num_seqs": 64, "max_model_len": MAX_MODEL_LEN}


@dataclass
class HTTPServer:
    deployment: Deployment
    base_url: str  # http://127.0.0.1:PORT/v1
    root: str  # http://127.0.0.1:PORT

    def client(self, **kw: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.Client(base_url=self.root, headers=headers, timeout=120, **kw)


def start_http_server() -> Iterator[HTTPServer]:
    # float32 and the float GGUF matmuls: outputs are compared with an in-process engine's,
    # batched differently (bf16 or int8 roundings would follow the batches)
    config = EngineConfig(
        dtype="float32",
        gguf_matmul="float",
        scheduler=SchedulerConfig(**ENGINE),
        cache=CacheConfig(block_size=16, num_blocks=NUM_KV_BLOCKS),
    )
    port = free_tcp_port()
    deployment = DeploymentConfig(http_port=port, api_key=API_KEY, max_body_mb=1.0)
    with Deployment(config, deployment) as dep:
        root = f"http://127.0.0.1:{port}"
        yield HTTPServer(dep, f"{root}/v1", root)
