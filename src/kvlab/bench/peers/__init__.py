"""The peers kvlab is measured against, each beside kvlab and never inside it: which run and how
(``plan``: Hugging Face transformers, llama.cpp, the vLLM peers), vLLM driven in its own interpreter
(``vllm_peer``, its worker ``vllm_worker`` run by path)."""
