"""The frontend process's room: the public endpoint's socket-free logic.

- `service.FrontendService`: client frames in, scheduler messages and client replies out.
- `prompts.PromptTokenizer`: prompts (text, token ids, chat) to validated token ids.

The process loop is `sarazmq.procs.frontend`.
"""
