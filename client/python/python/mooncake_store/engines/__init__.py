"""Native backends for serving engines, each loaded by the engine's own
plug-in mechanism (`sglang`: SGLang HiCache's dynamic storage backend)."""
