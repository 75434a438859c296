from frontend.openai.server import main

main()
