"""The draft model: the target's own layers run as a draft (plans), the
low-precision copies of its weights and their kernels, exit heads, draft
vocabularies, lookup drafts and the draft's sampling."""
