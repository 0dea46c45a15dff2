"""The `infermesh` console command: status of every service, classify and generate through the gateway."""
