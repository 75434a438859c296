from scheduler_proc.process import main

main()
