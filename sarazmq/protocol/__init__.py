"""Every wire type, one module per socket family; nothing here imports a process's internals.

- `client`: the public endpoint (client SDK <-> frontend ROUTER).
- `engine`: the request pipeline between processes (frontend -> scheduler -> detokenizers
  -> frontend, and the launcher's EngineDead / Drain to the frontend).
- `worker`: scheduler <-> workers (`BatchPlan` diffs, `StepResult`).
- `launcher`: every process -> launcher (Ready, Failed, Drained), and the node link
  between a multi-node deployment's head and its other nodes.
- `common`: what several families carry (`TokenLogprobs`, finish reasons).

Every frame is a msgspec Struct of a tagged union decoded with a typed decoder for its
socket, so a frame of the wrong kind is a decode error, never a surprise object. No
pickle anywhere.
"""
