"""Offline tools: corpus, tokenizer / target / drafter training for the shipped tiny pair, `bench spec`.

Not part of the services: nothing under verifier_service/, drafter_service/ or gateway/ imports this.
Each script runs as `python -m tools.<name>` from the repository root.
"""
