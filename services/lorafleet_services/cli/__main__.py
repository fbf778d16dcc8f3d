from lorafleet_services.cli import main

main()
