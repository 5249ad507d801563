"""The portable core: code that the harness and the standalone repro scripts share.

No module here imports anything from the rest of ``harness`` (only the standard
library, and torch, transformers, tokenizers, safetensors, requests and vLLM lazily,
inside functions), so that ``harness repro --emit`` can copy the modules a scenario
needs into one script that runs without the harness: the zoo's model recipes, the
deliberate corruptions, the shm backend's bucketing, the trainer-API detection by vLLM
release and the trainer's send code for each engine. Modules of this package may
import each other; the emitter drops those imports when it puts them into one file.
"""
