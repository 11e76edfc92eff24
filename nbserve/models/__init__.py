"""Models the engine runs: the StepModel protocol, the registry of native families, their
model files, weight formats, KV storage, and adapters for foreign modules."""
