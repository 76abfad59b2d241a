from kvlab.model.llama import LlamaModel
from kvlab.model.loader import LoadedModel, ModelLoadError, load_model
from kvlab.model.reference import dense_generate, dense_logits

__all__ = ["LlamaModel", "LoadedModel", "ModelLoadError", "dense_generate", "dense_logits", "load_model"]
