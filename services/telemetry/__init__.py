"""The TTFT breakdown of traced requests and the ``kvpush ttft`` report (tracing setup itself is
``kvpush.connector``'s: ``configure_tracing``)."""
