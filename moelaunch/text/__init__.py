"""Text in and out of the model: tokenizers, the chat template, the incremental detokenizer and the split
of a reply into its hidden reasoning and its answer. Nothing here knows about the engine."""
