from distrun.cli.main import main

main()
