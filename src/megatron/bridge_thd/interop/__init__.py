"""Other pipelines' packed formats: VERL's packed-sequence helpers, Energon / LLaVA-OneVision
``cu_lengths``, and boundaries after in-model image expansion. Built on the packer; never imported
by the step."""
