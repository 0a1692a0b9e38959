"""Job kinds: the registry (name -> params model, site check, runner; each imported only when
used) and the smoke job."""
