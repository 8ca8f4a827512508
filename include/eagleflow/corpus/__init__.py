"""Corpus phase: merge and shuffle the sources, chat template and loss masks, statistics, disk budget."""
