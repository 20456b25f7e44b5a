from benchmarks.accuracy.runner import main

main()
