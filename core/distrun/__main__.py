from distrun._cli.main import main

main()
