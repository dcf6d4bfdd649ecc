from paddle_cluster.cli import main

main()
