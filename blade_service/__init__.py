"""The service around the BLADE engine, under one namespace so that none of its packages collides with a
user's own `api`, `worker` or `cli` module: `contracts` (torch-free interfaces), `persistence` (shared by
api and worker), `api`, `worker`, `cli`, `client` and `migrations`. The science lives beside it, in
`blade_core`."""
