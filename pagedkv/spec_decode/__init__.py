"""Speculative decoding's proposers: cheap guesses of a request's next tokens, which the target model then
verifies in one pass (`ngram_proposer`: prompt lookup, no model; the draft model runs in pagedkv.worker)."""
