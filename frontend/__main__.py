from frontend.process import main

main()
