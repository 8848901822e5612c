from pyggspec.cli import main

main()
