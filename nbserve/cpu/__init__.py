"""CPU specifics: torch thread tuning, the OpenMP pool fix and nbserve's C kernels."""
