"""What the models built on the shared decoder (``torchtitan/layers/decoder.py``) have in
common beyond its blocks: argument checks and counts (``args``), tensor-parallel plans and
the parallelize order (``parallelize``), Hugging Face key mapping (``hf``) and the train
spec (``train_spec``)."""
