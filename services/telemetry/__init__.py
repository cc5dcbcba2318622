"""Tracing setup, span records, the TTFT breakdown and the ``kvpush ttft`` report."""
