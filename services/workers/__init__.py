"""Worker processes: the engine driver (`engine.EngineHost`) and the prefill/decode services."""
