"""The restorer stub (a freestanding program driven by syscall injection).

The stub itself arrives with the restore work; this package is where it lives.
"""
