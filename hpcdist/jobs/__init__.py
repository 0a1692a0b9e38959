"""Job kinds (node side; their light params modules are read on the login side too): the registry
(name -> params model, site check, runner; each imported only when used) and the smoke job."""
